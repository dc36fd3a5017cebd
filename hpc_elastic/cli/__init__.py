"""The ``hpc-elastic`` command line: thin click commands that build config and call the library."""
