"""A DHT that only takes stores, done at once, and keeps (key, subkey, value) of each: for what a peer publishes."""

import concurrent.futures


class StoringDHT:
    def __init__(self):
        self.stored: list[tuple] = []
        self.expirations: list[float] = []  # of each store, in order

    def store(self, key, subkey, value, expiration_time, return_future):
        self.stored.append((key, subkey, value))
        self.expirations.append(expiration_time)
        future = concurrent.futures.Future()
        future.set_result(True)
        return future
