#!/bin/bash
echo "Hello, $name!"
