"""What crosses between processes of a deployment: the router <-> worker messages and the spec a launcher
starts a worker from. Both ends import it; it imports neither (signed and framed by `kvbaton.wire`)."""
