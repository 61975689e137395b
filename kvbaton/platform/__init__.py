"""What kvbaton knows about the machine and the process it runs in (CPU features and compute paths
will live here too); the bottom of the compute stack."""
