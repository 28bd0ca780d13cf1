"""The plug-in for an existing LLM, in rooms that show how data flows:

- ``core``: engine-agnostic drafting. The sources (an index in process or over gRPC, the request's
  own text, the store of outputs), their merge and scoring, the cost of a step and what pays
  under it, the scheduler's deadlines, speculation and circuit breaker. It knows no engine.
- ``hf``: the transformers engine: the decoding loop, tree-attention verification, the KV cache,
  lossless sampling, the ``custom_generate`` plug-in and the measurement of its step cost.
- ``vllm``: the REST proposer vLLM runs, and the one shim that touches vLLM's private parts.
- ``llamacpp``: the draft model llama-cpp-python runs.
- ``outputs_corpus``: the model's own corpus, its plain replies to many prompts in a store of outputs.
- ``cli``: ``rest-generate``, ``rest-chat``, ``rest-measure-cost``, ``rest-fill-outputs``.

Engines depend on ``core``; ``core`` depends on no engine; the tools depend on both.
"""
