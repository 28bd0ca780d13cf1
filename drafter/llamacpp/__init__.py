"""REST inside llama.cpp (llama-cpp-python): the draft model (see ``rest_spec.drafter``)."""
