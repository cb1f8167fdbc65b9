"""Video: probing untrusted files under limits, cutting them into clips, and the clips' checks."""
