"""The driver side: requests, page allocator, scheduler, engine loop. Never touches CUDA."""
