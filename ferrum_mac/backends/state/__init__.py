"""What a sequence holds, shared by both backends: KV blocks, the prefix cache and its disk tier."""
