"""`kvbaton chat` and `kvbaton complete`: terminal clients of any OpenAI-compatible endpoint.

`endpoint` (one server: its model, streamed answers, its errors as one line), `sessions` (a chat
with its history, prompts to complete), `cli` (flags). Like `kvbaton.bench`, nothing here imports
the serving stack or torch: it runs wherever httpx does.
"""
