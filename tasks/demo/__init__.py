"""The demo: a generated corpus, its loopback web server, tiny encoders, the compose service."""
