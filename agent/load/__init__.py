"""``tokentrace load``: a load generator for OpenAI-compatible endpoints that traces each request
as a client span, so the collector can compute the network segment."""
