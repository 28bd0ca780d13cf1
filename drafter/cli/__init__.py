"""The command-line tools: ``rest-generate``, ``rest-chat``, ``rest-measure-cost``, ``rest-fill-outputs``."""
