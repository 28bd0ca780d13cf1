"""The benchmark harness: what more than one benchmark uses. Every benchmark (``benchmarks/NAME.py``,
``benchmarks/retrieval/``) is a script over it, run as ``python -m benchmarks.NAME``; a benchmark
imports the harness and the product (``rest_spec``), never another benchmark
(``tests/test_benchmark_harness.py`` checks it). By concern:

- ``report``: a run from its command line to its report: the options every benchmark spells
  alike, how a run decodes (``Decoding``), the report's header and file (``RESULTS``), targets, plots;
- ``sets``: the evaluation prompt sets (HumanEval, held-out ShareGPT, a codebase) and their indexes,
  built when missing;
- ``generation``: one prompt decoded by the transformers model (``model.generate``, the loop's
  figures);
- ``replay``: a drafter replayed against the model's greedy outputs, without the model, and the
  cache of those outputs;
- ``draftretriever``: REST's own engine, queried the way REST's code does, and as a drafter;
- ``retrieval_timing``: a retrieval engine timed in process and behind ``rest-datastore serve``;
- ``servers``: the ``rest-datastore`` servers, routers and latency proxy a benchmark starts, and
  the clients that drive load at them;
- ``latency_proxy``: a loopback TCP proxy adding a fixed round trip (``python -m
  benchmarks.harness.latency_proxy``);
- ``engines``: one vLLM engine in its own process running a JSON job (``python -m
  benchmarks.harness.engines JOB.json``), engine hosts for the tests, and the jobs the vLLM
  benchmarks build;
- ``engine_figures``: what an engine's run comes to: a mode's figures, where its step time goes;
- ``streams``: a deployment's request streams (held-out and warm-up prompts) and plain vLLM's
  cached greedy outputs of them;
- ``fleet_replay``: drafters replayed in a fleet on those outputs (suffix's caches against
  REST's shared store), in tokens a step.
"""
