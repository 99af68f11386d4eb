"""What clients speak: request parsing and routing text, headers, keys, admission, the answer relay, usage."""
