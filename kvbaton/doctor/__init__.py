"""`kvbaton doctor`: the four-step diagnosis of a running deployment (interconnect, KV watermark,
compute, routing), as a client of its HTTP endpoints."""
