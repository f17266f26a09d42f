"""Code shared by the controller and the host modules in library/ (standard library; psutil for processes)."""
