"""Text in and out, in whichever process talks to users: the tokenizer and chat template, the checkpoint's
sampling defaults, prompt forms, and output processing (detokenize, stop strings, logprobs) into vLLM-shaped
results. The frontend (router) and the offline engine use it; a worker only reads its tokenizer's ids."""
