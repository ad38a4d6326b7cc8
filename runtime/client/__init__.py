"""The client (the head): streams, continuous batching and sampling over a chain of stage workers, tokenizer and chat."""
