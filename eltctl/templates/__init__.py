"""Files the CLI writes for the user: the starter inventory (`eltctl init`)."""
