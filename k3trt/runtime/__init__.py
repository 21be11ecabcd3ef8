"""The runtime: requests, cache, scheduler, engine sessions, sampling, structured output."""
