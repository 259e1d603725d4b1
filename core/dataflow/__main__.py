"""``python -m dataflow``: the ``dataflow`` command (what ``torchrun -m dataflow`` runs)."""

from dataflow.cli.main import main

if __name__ == "__main__":
    main()
