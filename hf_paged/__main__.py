"""``python -m hf_paged``: the ``hf-paged`` command (see ``hf_paged.cli``)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
