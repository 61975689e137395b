"""`kvbaton bench serve`: an open-loop load generator for OpenAI-compatible servers.

One module per idea: `datasets` (what to send), `arrivals` (when), `sse` + `client` (how one
request streams), `runner` (one load level), `metrics` (the numbers), `report` / `plots`
(how they are shown), `cli` (flags). Nothing here imports the engine or torch.
"""
