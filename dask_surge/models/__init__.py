"""Encoders: model resolution (Hub, paths, objects), the fast transformer engine, micro-batching, model identity and the allocator settings a loaded model needs."""
