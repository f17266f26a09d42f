"""Development tools, not part of the product: regenerating the locks, the roles' READMEs."""
