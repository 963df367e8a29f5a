"""The ranks' protocol and set-up: process groups and rendezvous, start-up and the
agreements between ranks, the broadcast protocol (a fixed int64 header, then typed
buffers).
"""
