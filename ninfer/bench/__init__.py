"""``ninfer bench``: decode and prefill throughput against the memory roofline measured in the
same run, the HTTP server's overhead, and llama.cpp's llama-bench beside them (bench/README.md)."""
