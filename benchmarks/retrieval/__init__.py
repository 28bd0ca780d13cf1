"""Retrieval engine performance: our datastore against REST's ``draftretriever``, in one run.

    python -m benchmarks.retrieval --workdir indexes/bench --reuse --queries 1000 --growth 1 6 24

Two indexes, both with the packaged SmolLM2 tokenizer and built by the real ``build_index`` CLI:
the embedded ``sharegpt`` corpus less a held-out tail of conversations, and ``python-stdlib`` less
a held-out tail of files. ``draftretriever`` is built over exactly the same documents (read back
with ``Datastore.documents()``) and queried the way REST does (suffix lengths 16 down to 2,
k=5000, choices=budget, long=10).

Queries are 16-token windows of held-out text only, ending at uniformly random positions of it
(fixed seed). Figures per index, ours and theirs side by side with the ratio ours/theirs:
in-process draft latency (median, p99) at budgets 16 and 64, measured in alternating rounds after
a warm-up; draft nodes at budget 64; open time; resident memory added by opening (a fresh
process); bytes on disk per token; build time split into tokenization and suffix arrays. Ours
only (draftretriever has no server): gRPC round trip with one client and throughput with 1, 2 and
4 client processes against ``rest-datastore serve``. Growth: the ShareGPT token stream replicated
``f`` times (each copy in its own shuffled document order), latency at budget 64 against ``f=1``.

Indexes live in ``--workdir`` (``--reuse`` keeps those that match the settings; each has a
``NAME.build.json`` beside it recording how it was built and how long that took). Prints a
markdown table to stdout and saves every figure, the targets and pass/fail to
benchmarks/results/retrieval.json. Timings are only meaningful on an otherwise idle machine.
"""

GROWTH_SEED = 1234
BUILD_RECORD_VERSION = 1  # of the NAME.build.json files; older ones are not reused
