"""Multimodal inputs (E/P/D, issue 31): the images a request carries (`images`: taken in by the frontend,
torch-free); the processors, vision towers and encoder cache the workers run come next to them."""
