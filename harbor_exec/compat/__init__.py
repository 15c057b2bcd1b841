"""Adapters that run code written for other SDKs on harbor-exec (see ``osmosis``)."""
