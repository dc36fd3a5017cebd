"""Base error of hpc-elastic: the CLI turns it into one line on stderr and exit code 2."""


class HpcElasticError(Exception):
    """An error a user can act on; its message is one line that says what went wrong."""
