"""What may be fetched and kept: URL and address policy, robots.txt, licenses, captions, images."""
