"""Engine-agnostic drafting: sources, merge, cost, scheduling (see ``rest_spec.drafter``)."""
