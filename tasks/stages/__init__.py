"""The pretraining stages: fetch, download, validate, reshard, precache, release."""
