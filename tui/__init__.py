"""The Textual app: a thin front end over the edgellm core API."""
