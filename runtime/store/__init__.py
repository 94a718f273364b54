"""The job's store: the key-value server (`server`), its wire format (`wire`) and
limits (`limits`), the client every process connects with (`client`), its
addresses (`address`), signed values (`auth`), the process groups' signed
rendezvous store (`pgstore`) and riding through its loss (`loss`).

Standard library only, except `pgstore` and `loss` (torch): the control side
imports `server`, `client` and `auth`.
"""
