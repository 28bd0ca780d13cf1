"""What every part of the project shares, and nothing else of the project imports into: the draft
tree and request types (``types``), tokenizer loading and fingerprints (``tokenizer``), the
project's error types (``errors``), and the shell every command-line tool runs in (``cli``:
exit statuses, one-line errors, the logging format, in ``logs``)."""
