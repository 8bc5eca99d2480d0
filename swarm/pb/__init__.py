"""Generated protobuf and gRPC code; edit proto/*.proto and run scripts/gen_proto.py."""
