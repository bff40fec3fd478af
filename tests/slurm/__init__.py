"""A real Slurm cluster on localhost for the tests: see localcluster.sh and fixture.py."""
