"""The runtime's subcommands: serve, generate and run, chat, api, up (status, rebalance, down), keygen, proxy."""
