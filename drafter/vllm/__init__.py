"""REST inside vLLM: the ``custom_class`` proposer and its shim (see ``rest_spec.drafter``)."""


def __getattr__(name: str):  # names documented when this package was one module (rest_spec._moved)
    from rest_spec._moved import moved_name

    return moved_name(__name__, name)
