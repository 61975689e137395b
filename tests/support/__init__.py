"""What the tests share: tiny checkpoints and reference outputs, the server and PD harnesses, waits."""
