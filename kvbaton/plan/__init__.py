"""`kvbaton plan`: capacity planning (KV memory, TP/PP, P:D ratio, GPU count) on top of the simulator."""
