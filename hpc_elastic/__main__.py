"""``python -m hpc_elastic`` runs the ``hpc-elastic`` command."""

from hpc_elastic.cli.main import main

if __name__ == "__main__":
    main()
