"""Structured outputs: a grammar (JSON schema, regex, choice, Lark/GBNF) that every sampled token must
obey. The spec travels with a request's SamplingParams (torch-free); `grammar` compiles it with
llguidance and caches it by spec; `matchers` (runner side) turns each step's matcher states into one
batched token bitmask."""
