# The checks of this task; run by test.sh in /app.
import configparser
c = configparser.ConfigParser()
c.read('/app/config.ini')
assert c['server']['port'] == '8080'
assert c['server']['host'] == '0.0.0.0'
assert c['client']['port'] == '9000'
assert c['client']['retries'] == '3'
print('all checks passed')
