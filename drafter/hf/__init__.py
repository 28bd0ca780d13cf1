"""The transformers engine: the REST decoding loop and its tree-attention verifier (see ``rest_spec.drafter``)."""
