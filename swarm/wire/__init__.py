"""Codecs, tensor <-> protobuf and framing, a link over one gRPC stream, what a receiver accepts."""
