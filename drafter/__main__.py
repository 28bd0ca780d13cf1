"""``python -m rest_spec.drafter`` runs ``rest-generate`` (``drafter.cli.rest_generate``)."""

import sys

from rest_spec.drafter.cli.rest_generate import main

if __name__ == "__main__":
    sys.exit(main())
