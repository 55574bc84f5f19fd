"""Speculative decoding: the proposer interface and the proposers (ngram, draft model / self, DFlash with its drafter), built by factory.py."""
