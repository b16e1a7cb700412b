select status from subscriptions where id = $1
