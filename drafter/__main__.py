"""``python -m rest_spec.drafter`` runs ``rest-generate`` (``drafter.cli``)."""

import sys

from rest_spec.drafter.cli import main

if __name__ == "__main__":
    sys.exit(main())
