"""What ``model.generate(..., custom_generate=drafter.hf.plugin.REST_GENERATE_DIR, trust_remote_code=True)``
runs: transformers loads ``generate`` from this file and passes it every argument of the call."""

from rest_spec.drafter.hf.plugin import generate_with_drafts as generate

__all__ = ["generate"]
