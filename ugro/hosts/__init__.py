"""Talking to the hosts: the inventory, running a playbook with ansible-runner, the code a launch ships."""
