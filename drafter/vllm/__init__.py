"""REST inside vLLM: the ``custom_class`` proposer and its shim (see ``rest_spec.drafter``)."""
